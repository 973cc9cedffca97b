"""``kvserve bench``: the command's line (:mod:`.report_cli`, no torch import), its run and report
(:mod:`.report`), and the measures it is made of (:mod:`.fidelity`, :mod:`.quality`, :mod:`.needle`,
:mod:`.in_process`). The benchmarks under ``bench/`` import these; nothing here imports ``bench``.
"""
