"""opd-score: teacher log-probs, shift tensors and verifier rewards for rollout records (not built yet)."""

from opd_common.unbuilt import unbuilt_command

main = unbuilt_command("opd-score", "teacher log-probs, shift tensors and verifier rewards for rollout records", "issue 3")

if __name__ == "__main__":
    main()
