"""Reading the deployment's env files (.env.example, config.env) and running the settings under them."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from tests.processes import manage

ASSIGNMENT = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


def read_env_file(path: Path) -> dict[str, str]:
    """`NAME=value` lines (comments and blanks skipped), as docker compose and kustomize read them."""
    values = {}
    for line in path.read_text().splitlines():
        match = ASSIGNMENT.match(line.strip())
        if match:
            values[match.group(1)] = match.group(2)
    return values


def write_env_file(path: Path, values: dict[str, str]) -> Path:
    path.write_text("".join(f"{name}={value}\n" for name, value in values.items()))
    return path


def generated_secret() -> str:
    """A secret as the README says to make one (URL-safe, so it also fits inside DATABASE_URL)."""
    return secrets.token_urlsafe(48)


def seconds(duration: str | int) -> float:
    """A Compose/Kubernetes duration (`45s`, `1m30s`, `50`) in seconds."""
    if isinstance(duration, int):
        return float(duration)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration)
    if not parts or not any(parts.groups()):
        return float(duration)
    hours, minutes, secs = (float(group or 0) for group in parts.groups())
    return hours * 3600 + minutes * 60 + secs


def settings_check_deploy(environment: dict[str, str]) -> str:
    """`manage.py check --deploy` with exactly the deployment's environment (plus PATH): the settings
    must load and accept every value the deployment gives them."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **environment}
    return manage(env, "check", "--deploy", "--fail-level", "WARNING")
