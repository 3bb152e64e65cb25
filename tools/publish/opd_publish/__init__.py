"""opd_publish."""
