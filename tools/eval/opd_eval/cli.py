"""opd-eval: benchmark evaluation with math-verify, avg@n, pass@k and paired CIs (flags only;
the work is in run.run, compare.compare and report.write)."""

from __future__ import annotations

import sys

import click

from opd_common.cli_util import CONTEXT, console_main, setup_logging, tool_command

from .config import EvalConfig


@click.group(name="opd-eval", context_settings=CONTEXT)
def command():
    """Evaluate a model (+ LoRA adapter) on math benchmarks; compare and report results.

    \b
      opd-eval run --model M --bench aime24 -n 12 --out base.json | jq .avg
      opd-eval run --model M --run-dir run/ --checkpoint 100 --bench aime24 -n 12 --out step100.json
      opd-eval compare base.json step100.json | jq '.comparisons[0].ci'
      opd-eval report results/          # report.md + accuracy.png
      opd-eval ls                       # bundled benchmarks

    Results files hold the config, model/adapter/benchmark hashes, every graded sample and the
    metrics; stdout carries results only, tables and progress go to stderr. docs/eval.md has
    the schema, the metric formulas and the statistics.
    """


@tool_command("run", EvalConfig, group=command)
def run_cmd(config: EvalConfig) -> int:
    """Sample n responses per problem, grade them, write one results JSON (--out).

    \b
      opd-eval run --model Qwen/Qwen3-1.7B --bench aime24 -n 12 --temperature 1.0 \\
          --thinking on --max-tokens 38912 --out base.json | jq .avg
      opd-eval run --model M --data my.jsonl --problem-field question --answer-field final -o my.json

    Samples are graded and saved to OUT.progress.jsonl as each chunk finishes; an interrupted
    run continues with --resume. stdout gets one JSON line of overall metrics; a table goes to
    stderr.
    """
    from .run import run

    return run(config)


@tool_command("ls", group=command)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per benchmark instead of a table.")
def ls_cmd(as_json):
    """List the bundled benchmarks: name, problems, source (repo@commit), description.

    \b
      opd-eval ls --json | jq -r .name
    """
    import orjson

    from .benchmarks import listing

    entries = listing()
    if as_json:
        for e in entries:
            click.echo(orjson.dumps(e).decode())
        return
    click.echo(f"{'name':<9} {'problems':>8}  {'source':<40} description")
    for e in entries:
        click.echo(f"{e['name']:<9} {e['problems']:>8}  {e['source']:<40} {e['description']}")


@tool_command("compare", group=command)
@click.argument("results", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--resamples", type=int, default=10_000, show_default=True,
              help="Bootstrap resamples (and permutations).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the bootstrap and permutation draws.")
@click.option("--force", is_flag=True,
              help="Compare results of different benchmarks/settings over their shared problems.")
@click.option("--quiet", is_flag=True, help="No table on stderr.")
def compare_cmd(results, resamples, seed, force, quiet):
    """Paired comparison of results with the first file (the baseline), problem by problem.

    \b
      opd-eval compare base.json step100.json | jq '.comparisons[] | {file, diff, ci, p_value}'

    For each other file: the difference in avg@n, a paired bootstrap 95% CI over problems, a
    paired permutation p-value and per-problem wins/losses/ties. JSON on stdout, a table on stderr.
    """
    import orjson

    from .compare import compare
    from .render import compare_table

    setup_logging(quiet)
    report = compare(list(results), resamples, seed, force)
    if not quiet:
        click.echo(compare_table(report), err=True)
    click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())


@tool_command("report", group=command)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Write report.md and accuracy.png here [default: DIRECTORY].")
@click.option("--resamples", type=int, default=10_000, show_default=True,
              help="Bootstrap resamples for the paired CIs.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the bootstrap and permutation draws.")
@click.option("--force", is_flag=True, help="Report results with different sampling settings side by side.")
@click.option("--quiet", is_flag=True, help="No log lines on stderr.")
def report_cmd(directory, out_dir, resamples, seed, force, quiet):
    """Results of several checkpoints in DIRECTORY -> report.md (table) + accuracy.png (plot).

    \b
      opd-eval report results/ && cat results/report.md | head

    Each benchmark gets a table of avg@n (95% CI), pass@k, maj@n, format and truncation rates by
    training step, with the paired difference to step 0; the plot shows accuracy with CI bars
    against step. The Markdown also goes to stdout.
    """
    from pathlib import Path

    from .report import write

    setup_logging(quiet)
    text, md, png = write(Path(directory), Path(out_dir) if out_dir else None, resamples, seed, force)
    click.echo(text)
    click.echo(f"opd-eval report: wrote {md} and {png}", err=True)


def main(argv: list[str] | None = None):
    """The opd-eval console script (see opd_common.cli_util.console_main)."""
    console_main(command, sys.argv[1:] if argv is None else argv, "opd-eval")


if __name__ == "__main__":
    main()
