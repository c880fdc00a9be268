"""Bundled environments: each a small task built on molt_env and molt_agents only."""
