import sys

from fived.cli import main

sys.exit(main())
