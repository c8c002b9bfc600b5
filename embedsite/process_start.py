"""Python's cyclic garbage collector around a process's start-up.

A web or worker process imports Django, the app and their libraries once (a few hundred thousand
objects) and keeps them until it exits. While they are imported the collector runs again and again
and frees nothing; afterwards every full collection walks them all again. So the entry points that
start a process (manage.py, embedsite.asgi) pause the collector (`begin`), and once Django is set up
(embeddings/apps.py) and the ASGI application built, `end` moves everything start-up made to the
collector's permanent generation (`gc.freeze`), which collections skip, and resumes collecting if
`begin` paused it. Celery's processes start through Django's set-up too: theirs is frozen as well,
before the prefork pool forks its children (which then share those pages instead of copying them).
"""

from __future__ import annotations

import gc

_paused_by_start_up = False


def begin() -> None:
    """Pause the collector for start-up, unless something already stopped it."""
    global _paused_by_start_up
    if gc.isenabled():
        gc.disable()
        _paused_by_start_up = True


def end() -> None:
    """Freeze what start-up built; collect again if `begin` paused the collector. Called again later
    in start-up (the ASGI application after Django's set-up), it freezes what came since."""
    global _paused_by_start_up
    gc.freeze()
    if _paused_by_start_up:
        _paused_by_start_up = False
        gc.enable()
