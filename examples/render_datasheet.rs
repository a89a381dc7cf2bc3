fn main() {
    print!(
        "{}",
        paratune::coefficients::render_cost_model(&paratune::coefficients::CostModel::datasheet())
    );
}
