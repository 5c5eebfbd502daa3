"""``redline tune``: find the fastest way to run the user's own training script on this machine by running it.

``space`` says what may change (the knobs and their values on this machine), ``trial`` runs the script once
with one candidate through ``redline run`` and measures it, ``journal`` keeps every trial on disk (a killed
tune resumes, a re-tune on the same machine is instant), ``search`` decides what to try next and checks that
the winner trains as the baseline does.
"""
