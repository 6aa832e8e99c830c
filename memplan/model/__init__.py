"""Model sources and parameter inventories (no torch on the analytic path)."""
