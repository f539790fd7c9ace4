"""What two or more views need (inputs, the default prompt, the weights basis, the heads' spectra, rotary checks and
μ, token circuits of heads, the token sets, the pages' claims, the heads table the derived analyses read). The views
import these, never each other; nothing here imports a view (make lint: lint-imports)."""
