"""opd-eval: benchmark evaluation with math-verify, avg@n, pass@k and paired CIs (not built yet)."""

from opd_common.unbuilt import unbuilt_command

main = unbuilt_command("opd-eval", "benchmark evaluation with math-verify, avg@n, pass@k and paired CIs", "issue 5")

if __name__ == "__main__":
    main()
