"""Results: reading a run folder (`run_data`), statistics and verdicts (`stats`, `paired_accuracy`,
`verdict`), summary.json (`summary`), the report and its plots, and the gate with its policy."""
