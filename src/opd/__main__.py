"""``python -m opd`` runs the same command-line interface as ``opd``."""

from opd.cli import main

if __name__ == "__main__":
    main()
