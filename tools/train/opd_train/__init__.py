"""opd_train."""
