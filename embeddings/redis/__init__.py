"""Redis, wrapped once: connections, the transports, every Lua script and key, and typed operations.

    connections.py  the process's clients and pools (critical Redis, job store; sync and asyncio)
                    and the hand-written lean asyncio client
    transport.py    operations written once as generators, run by `operation_run_sync` or `operation_run`;
                    EVALSHA with the one NOSCRIPT reload
    scripts.py      every Lua script, a named `Script` each
    keys.py         every key: its layout, type and TTL (the docstring's table), and its name
    operations.py   the typed operations of quotas, usage and jobs
    memory.py       a server's INFO memory and stats: what it holds against its maxmemory

Nothing Django but the settings the connections read; the services hold the policy.
"""
