"""Tools over runs and plans: dry runs, diagnose, reports, explore pages, and generation."""
