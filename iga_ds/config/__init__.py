"""One typed config: the run YAML (:mod:`~iga_ds.config.run`), the ``iga`` block of the DeepSpeed
JSON (:mod:`~iga_ds.config.hook`), how the two are resolved into one run
(:mod:`~iga_ds.config.deepspeed`), all validated by :func:`~iga_ds.config.base.validate_section`.
docs/CONFIG.md is generated from the fields (:mod:`~iga_ds.config.reference`)."""
