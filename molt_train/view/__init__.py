"""`molt-view`: a local web viewer of runs' metrics and saved rollouts (`server` serves `page.html` and the JSON
that `runs` reads from the run directories)."""
