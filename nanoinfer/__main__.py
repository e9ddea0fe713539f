"""`python -m nanoinfer serve MODEL [options]`."""
import sys

from nanoinfer.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
