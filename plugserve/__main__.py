import sys

from plugserve.cli import main

sys.exit(main())
