import sys

from specaudit.commands.cli import main

if __name__ == "__main__":  # a spawned child (vLLM's engine core) re-imports this module as __mp_main__
    sys.exit(main())
