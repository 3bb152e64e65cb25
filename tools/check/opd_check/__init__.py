"""opd-check: a preflight that checks a run's pieces agree (docs/check.md)."""
