"""The launcher's verbs, each a `main(values, args)` standing on the launch core
(cli.py): doctor, env, verify, systemd-unit, tune. No verb imports another, and
none imports the CLI (pyproject.toml's import-linter contracts)."""
