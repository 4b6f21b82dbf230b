"""The launcher's verbs, each a `main(values, args)` standing on the launch core
(launch.py): doctor, env, verify, systemd-unit, tune. No verb imports another, nor the
command line above them (cli.py): pyproject.toml's import-linter contracts."""
