import sys

from fived.cli.main import main

sys.exit(main())
