"""The basics every package uses: the machine's hardware, atomic files, one-line user errors.
Imports nothing: ``specdraft.heads`` reads ``system.files`` (the stdlib only), and an import here
would pull its neighbours' dependencies (omegaconf, through ``errors``) into heads."""
