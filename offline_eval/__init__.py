"""Offline evaluation: strict global time split, metrics, strata, baselines, reports."""
