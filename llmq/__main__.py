"""`python -m llmq`: the same command as the `llmq` script (the supervisor starts children so)."""

from __future__ import annotations

import sys

from llmq.cli import main

if __name__ == "__main__":
    sys.exit(main())
