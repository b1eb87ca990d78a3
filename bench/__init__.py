"""`swarmlm bench` / `python -m bench`: the swarm measured side by side with its reference, in one run.

Modules:
    cli        flags -> Plan, runs the chosen scenarios over the chosen models, writes the report
    plan       Plan: what to run (quick / full presets), frozen and validated
    runner     runs a Plan: per model the wire scenario, then each split with the model scenarios
    models     the benchmark models: the built-in default model and random Llama configs saved once
    harness    one model's swarm on this machine (LocalSwarm), its splits into 1..3 peers, the local reference
    stats      Row (one measured figure vs its reference and target) and sample summaries
    memory     resident memory of processes, and of a process holding the whole local model
    load       how busy other processes kept the machine while a scenario ran
    report     results.json, results.md and the figures; `python -m bench.report --from RUN/results.json` redraws them
    plots      a scenario's figure from its rows: ratios to the reference, targets, the run's date
    scenarios/ decode, prefill, train (forward+backward), wire, concurrency, startup (and memory)
    verify     `python -m bench.verify`: what client spot checks cost, forward+backward at fractions 0, 0.05, 1
    hop_profile `python -m bench.hop_profile`: where a decode step's milliseconds go, client and each peer

Timings are never asserted by tests; they are reported as ratios to a reference measured in the same run.
"""
