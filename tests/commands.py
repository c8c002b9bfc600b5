"""Several manage.py commands run in one process: each manage.py pays Django's start-up (seconds on a
loaded machine), which a test's setup of a tenant and its key paid two or three times."""

from __future__ import annotations

import json

from tests.processes import manage

# The commands as call_command runs them, in order; each one's stdout collected, its stderr (notes
# such as create_api_key's "store it now") dropped. A command that fails fails `manage`.
RUN_IN_ORDER = """
import io, json
from django.core.management import call_command
outputs = []
for name, *arguments in json.loads({commands!r}):
    out = io.StringIO()
    call_command(name, *arguments, stdout=out, stderr=io.StringIO())
    outputs.append(out.getvalue().strip())
print(json.dumps(outputs))
"""


def manage_in_one_process(env: dict[str, str], *commands: list[str]) -> list[str]:
    """Run each `[name, *arguments]` of `commands` as `manage.py name arguments` would, all in one
    `manage.py shell`; their stdouts, stripped, in order."""
    output = manage(env, "shell", "-c", RUN_IN_ORDER.format(commands=json.dumps(commands)))
    return json.loads(output.splitlines()[-1])


def tenant_with_key(env: dict[str, str], slug: str, *options: str, name: str | None = None) -> str:
    """`create_tenant --slug slug [options]` and `create_api_key --tenant slug` in one process: the key."""
    _, key = manage_in_one_process(
        env,
        ["create_tenant", "--name", name or slug, "--slug", slug, *options],
        ["create_api_key", "--tenant", slug],
    )
    return key
