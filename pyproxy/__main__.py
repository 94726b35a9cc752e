import sys

from pyproxy.cli import main

sys.exit(main())
