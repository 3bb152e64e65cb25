"""opd_score."""
