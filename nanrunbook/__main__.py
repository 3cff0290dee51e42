from nanrunbook.cli import main

main()
