"""opd-publish: verified checkpoint publishing to the Hugging Face Hub (not built yet)."""

from opd_common.unbuilt import unbuilt_command

main = unbuilt_command("opd-publish", "verified checkpoint publishing to the Hugging Face Hub", "issue 6")

if __name__ == "__main__":
    main()
