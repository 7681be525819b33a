use oomguard::no_grad;

#[no_grad]
struct Model;

fn main() {}
