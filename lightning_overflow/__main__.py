import sys

from lightning_overflow.cli import main

sys.exit(main())
