"""The command-line programs, one module per command, above the library they drive.

    megalab-train      train          Hydra: train a model (`experiment=...`)
    megalab-eval       eval           Hydra: test a checkpoint
    megalab-generate   generate       Hydra: sample text from a language-model checkpoint
    megalab-translate  translate      translate with a WMT'16 checkpoint (beam search)
    megalab-sweep      sweep          run a sweep YAML as Hydra multiruns, without a W&B server
    megalab-export     export         write a run as a shareable model folder
    megalab-tables     tables         paper-vs-ours tables and sweep plots of runs
    megalab-data       data           prepare, check and generate datasets
    python -m megalab.cli.curves      loss curves and tokens/s of language-model runs
    python -m megalab.cli.eval_runs   test finished runs again with other settings

Every command also runs as `python -m megalab.cli.<module>`. The modules before this package
(`python -m megalab.train`, `megalab.data.cli`, `megalab.tables`, ...) still run, saying which
command replaces them (`megalab.cli.deprecated`). Nothing in the library imports this package;
importing it imports nothing, so that `train` configures the runtime before torch loads.
"""
