import sys

from specaudit.cli import main

sys.exit(main())
