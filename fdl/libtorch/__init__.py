"""libtorch and torch builds: the catalog of official builds, the on-disk store, installs."""
