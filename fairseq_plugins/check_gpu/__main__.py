import sys

from fairseq_plugins.check_gpu.command import main

sys.exit(main())
