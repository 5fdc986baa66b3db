import sys

from torchpulse.cli import main

sys.exit(main())
