import sys

from labs.cli import main

sys.exit(main())
