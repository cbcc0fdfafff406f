"""`python -m fairseq.plan_memory`, the planner's documented command: fairseq.planning.plan_memory."""

import sys

if __name__ == "__main__":
    from fairseq.planning.plan_memory import main

    sys.exit(main())
else:
    from fairseq.planning import plan_memory as _module

    sys.modules[__name__] = _module
