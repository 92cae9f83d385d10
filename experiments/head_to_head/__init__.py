"""The head to head: the harness that tunes and runs every optimizer alike, its reports, baselines and provenance."""
