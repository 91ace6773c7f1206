"""`ppgd-tpu report`: a static site showing what each component of a run does.

command.py parses the command and orchestrates; scan.py is the jitted pass over held-out
rows (CI statistics, top contexts); site.py writes the site from assets/ (HTML, JS, CSS,
no network). It reads a run like `ppgd-tpu eval` (engine.restore_committed); nothing
below the command layer imports it.
"""
