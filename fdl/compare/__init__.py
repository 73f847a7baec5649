"""fdl compare: a user's own script once per policy and seed, each a real ``fdl run``, then the
runs side by side (plan, run, results, figures, recommend, render); no torch in this process."""
