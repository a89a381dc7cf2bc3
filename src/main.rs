//! The paratune command line: parse, call the library, print. The only
//! place that knows about the terminal; errors become one line and exit 2.

mod cli;

use clap::Parser;
use cli::args::{Cli, Command};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Plan(args) => cli::commands::plan(args),
        Command::Predict(args) => cli::commands::predict_command(args),
        Command::Evaluate(args) => cli::commands::evaluate_command(args),
        Command::Calibrate(args) => cli::calibrate::run(args),
        Command::Profile(command) => cli::profile::run(command),
        Command::Ingest(command) => cli::ingest::run(command),
        Command::Validate(args) => cli::validate::run(args),
        Command::Models(args) => cli::commands::models(args.format),
        Command::Gpus(args) => cli::commands::gpus(args.format),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let message = format!("{error:#}").replace('\n', " ");
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}
