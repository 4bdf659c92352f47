import sys

from eagle3.cli import main

sys.exit(main())
