"""The run directory: what ``fdl run`` and the engine leave on disk, and everything that reads it
back. One module per file contract, which both writes the file and checks it when read::

    runs/<UTC>-<script>-<policy>/      layout.py    (the entries, new/resume/overwrite rules)
        config.json                    config.py    (the launcher's, and the engine's part)
        logs/rank<r>.log, agent.log    layout.py
        logs/rank<r>.crash.json        crash.py     (what ended a worker that raised)
        metrics.jsonl                  metrics.py   (one record per epoch)
        summary.json                   summary.py   (the run's figures: a contract for tools)
        model.pt                       model.py     (the consensus state_dict)
        progress.json                  progress.py  (rank 0's live snapshot)
        checkpoints/ckpt-r<round>/     checkpoints.py
        timeline/rank<r>.jsonl         timeline.py  (per-rank events; the node samples' files)
        timeline/timeline.{json,csv,html}, trace.json, curves.png
                                       timeline_merge.py, timeline_html.py, timeline_trace.py,
                                       timeline_plot.py
        tensorboard/                   layout.py (the default directory of --tensorboard)

``report.py`` is ``fdl report``: where the time of a run went, from summary.json and the
timelines. Nothing outside this package names a run-directory file or knows a field of one
(tests/rundir/test_contracts.py holds it). The package imports only fdl's base modules; torch
only inside the functions that save and load tensors.
"""
