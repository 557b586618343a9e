import os
import sys

# Tests import helpers as ``tests.envs``; workers find them through the learner's sys.path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
