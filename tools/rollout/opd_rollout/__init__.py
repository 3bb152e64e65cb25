"""opd_rollout."""
