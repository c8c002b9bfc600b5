#!/usr/bin/env python
"""Django's command-line entry point for embedsite."""

import os
import sys


def main() -> None:
    from embedsite import process_start

    process_start.begin()  # Django's set-up resumes the collector (embedsite/process_start.py)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
