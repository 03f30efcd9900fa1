import sys

from lowbit.runtime.cli.main import main

sys.exit(main())
