from nanwatch.cli import main

main()
