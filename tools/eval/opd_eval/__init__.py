"""opd_eval."""
