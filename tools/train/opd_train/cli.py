"""opd-train: LoRA training over scored records under a step budget (not built yet)."""

from opd_common.unbuilt import unbuilt_command

main = unbuilt_command("opd-train", "LoRA training over scored records under a step budget", "issue 4")

if __name__ == "__main__":
    main()
